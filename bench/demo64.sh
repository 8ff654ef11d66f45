# Sourced by the bench scripts that run the 64-expert demo model: sets REPO, PY (PYTHON or the
# repo's .venv) and MODEL (default: the demo model in bmoe-demo's user cache, the file
# `bmoe-demo --experts 64 --top-k 8` writes and every other tool reuses), building it when missing.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
if [[ -z ${MODEL:-} ]]; then
  MODEL=$("$PY" -c 'from bmoe.demo.build import default_path; print(default_path(64, 8))')
  [[ -f $MODEL ]] || "$PY" -m bmoe.demo.build --experts 64 --top-k 8
fi
[[ -f $MODEL ]] || { echo "bench: no model at $MODEL; set MODEL=path to a GGUF file" >&2; exit 1; }
