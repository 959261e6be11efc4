# shellcheck shell=bash
# Sourced by run_local.sh and run_multinode.sh (not run by itself): the interpreter, and the
# checks of the arguments they pass on to launch/train.py. The caller defines REPO and usage().

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then
        PYTHON="$REPO/.venv/bin/python"
    else
        PYTHON=python3
    fi
fi

# check_train_args NAME WHY ARGS...: usage (exit 2) without arguments, usage and train.py's
# flags for -h/--help, and exit 2 naming WHY unless ARGS hold --ckpt-dir.
check_train_args() {
    local name=$1 why=$2 arg
    shift 2
    if [[ $# -eq 0 ]]; then
        usage >&2
        exit 2
    fi
    case "$1" in
        -h | --help)
            usage
            echo
            exec "$PYTHON" "$REPO/launch/train.py" --help
            ;;
    esac
    for arg in "$@"; do
        case "$arg" in
            --ckpt-dir | --ckpt-dir=*) return 0 ;;
        esac
    done
    echo "$name: error: --ckpt-dir DIR is required ($why)" >&2
    usage >&2
    exit 2
}
