# Sourced by the bench scripts that run the 64-expert demo model: sets REPO, PY (PYTHON or the
# repo's .venv) and MODEL (default bench/models/demo64.gguf), building the model with bmoe-demo
# when the file is missing.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
MODEL=${MODEL:-$REPO/bench/models/demo64.gguf}
if [[ ! -f $MODEL ]]; then
  mkdir -p "$(dirname "$MODEL")"
  "$PY" -m bmoe.tools.demo --experts 64 --top-k 8 -o "$MODEL"
fi
