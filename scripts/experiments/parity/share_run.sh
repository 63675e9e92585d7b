# Sourced by eagle3.sh and argmax_ab.sh: share_run RUN DEST FEATURES makes DEST a run folder with RUN's prepared
# rows, draft vocabulary and manifests (copied: training writes beside them) and FEATURES as its offline cache
# (linked, not copied: the cache is the large part and training only reads it); no checkpoints, no metrics.
share_run() {
    local run=$1 dest=$2 features=$3
    rm -rf "$dest" && mkdir -p "$dest"
    for item in "$run"/*; do
        case $(basename "$item") in
            features) ln -s "$features" "$dest/features" ;;
            checkpoints|metrics.jsonl) ;;
            *) cp -a "$item" "$dest/" ;;
        esac
    done
}
