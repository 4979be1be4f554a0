# shellcheck shell=bash
# The Python environment of ovq's scripts: a virtual environment with python/requirements-dev.txt
# (and, without their dependencies, python/requirements-nodeps.txt) installed from PyPI, made
# once per machine outside the clone and kept there, keyed by the requirements' contents (a
# change of them makes a new one). Source, don't run.
#
#   ovq_python_env    prints the environment's directory, creating it first if needed
#
# Environment: OVQ_PYTHON_ENV_ROOT (default ~/.cache/ovq) holds the environments. The first run on
# a fresh machine downloads torch (about 3 GB with its CUDA libraries, which also run on a CPU).

ovq_python_env() {
  local top
  top=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  local req="$top/python/requirements-dev.txt" nodeps="$top/python/requirements-nodeps.txt"
  local key
  key=$(cat "$req" "$nodeps" | sha256sum | cut -c1-12)
  local dir="${OVQ_PYTHON_ENV_ROOT:-$HOME/.cache/ovq}/venv-$key"
  if [[ ! -f "$dir/.complete" ]]; then
    echo "ovq: creating the Python environment $dir (once per machine)" >&2
    rm -rf "$dir"
    mkdir -p "$(dirname "$dir")"
    python3 -m venv "$dir" >&2 || return 1
    "$dir/bin/python" -m pip install --quiet --upgrade pip >&2 || return 1
    "$dir/bin/python" -m pip install --quiet -r "$req" >&2 || return 1
    "$dir/bin/python" -m pip install --quiet --no-deps -r "$nodeps" >&2 || return 1
    touch "$dir/.complete"
  fi
  echo "$dir"
}
