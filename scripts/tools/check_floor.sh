#!/usr/bin/env bash
# Run the core tests against the oldest transformers that pyproject.toml allows, in a throwaway venv that shares
# the other installed packages:  bash scripts/tools/check_floor.sh [VERSION]   (default: the floor, 5.0.0)
set -euo pipefail
cd "$(dirname "$0")/../.."
version="${1:-5.0.0}"
venv="$(mktemp -d)/floor"
python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q "transformers==$version"
"$venv/bin/python" -c "import transformers; print('transformers', transformers.__version__)"
# A cache of its own: the built-in target is converted by this transformers version too.
DRAFTTRAIN_CACHE="$(dirname "$venv")/cache" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_targets.py tests/test_chat.py tests/test_drafts.py tests/test_eagle_proposer.py \
  tests/test_decoding_greedy.py tests/test_trainer.py tests/test_data_masks.py tests/test_train_smollm2.py \
  tests/test_regenerate.py tests/test_eval_cli.py
