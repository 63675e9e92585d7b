#!/usr/bin/env bash
# What scripts/tools/gpu/checks.sh needs beside the repository, staged here in .gpu/ (git-ignored through
# .git/info/exclude; copied to the GPU machine with the checkout): the wheels the device image lacks, for its
# Python 3.12 (transformers at this machine's version too: 5.17 converts the GGUF's tokenizer differently, and a draft
# or an answer store made with one is refused by the other), and SmolLM2-135M-Instruct's config and tokenizer for
# the random-weight target of the "shape" checks.
#
#   bash scripts/tools/gpu/stage.sh        # about 9 MiB; then: bash scripts/tools/gpu/checks.sh OUT shape   (on the device)
set -euo pipefail
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >>.git/info/exclude
mkdir -p .gpu/whl
# versions as installed here; DeepSpeed publishes no wheel, so it is built (pure Python: no ops compiled)
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
    "pydantic==$(version pydantic)" "pydantic_core==$(version pydantic_core)" annotated-types typing-inspection \
    "datasets==$(version datasets)" "dill==$(version dill)" "multiprocess==$(version multiprocess)" hjson \
    "gguf==$(version gguf)" "transformers==$(version transformers)"
ls .gpu/whl/deepspeed-*.whl >/dev/null 2>&1 ||
    python3 -m pip wheel -q --no-deps --no-build-isolation -w .gpu/whl "deepspeed==$(version deepspeed)"
python3 - <<'PY'
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from drafttrain.targets.loading import builtin_gguf_path

gguf = Path(builtin_gguf_path("smollm2-135m-instruct"))
out = Path(".gpu/smol_cfg")
AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
PY
du -sh .gpu
