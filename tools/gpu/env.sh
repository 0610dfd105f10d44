# Sourced at the start of every device call (`source tools/gpu/env.sh`), from the project root:
# installs the carried wheels (.whl/, tools/gpu/fetch_kit.sh) for this call, restores the compiled
# kernel caches carried in .gpucache/ (a fresh machine compiled FlashInfer's prefill kernels for
# 89 s), and defines `save_caches`, which writes them back under $OUT in 15 MiB parts; copy those
# files into .gpucache/ on the development machine for the next call.
# One fixed path on every machine, not a fresh temporary folder: FlashInfer's JIT cache keeps build
# files naming the include paths of the package they were written from. On 2026-12-05 a fresh
# machine given the cache of an earlier call (its package under another mktemp folder) failed to
# build FlashInfer's batch prefill kernel of head_dim 64 ("Ninja build failed", the rest of the
# message cut off): that cache's build.ninja names /tmp/tmp.TtNpSQw5ZS/flashinfer/data/include and
# tvm_ffi/include, gone on the new machine. A fixed path keeps them valid (not yet run on a device).
S=/tmp/mstar-gpu-site
rm -rf "$S"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$S" .whl/*.whl
export PYTHONPATH="$S:$PWD"
export FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE="$HOME"  # FlashInfer's JIT cache: $HOME/.cache/flashinfer
export TRITON_CACHE_DIR="$HOME/.triton/cache"
mkdir -p "$HOME/.cache" "$TRITON_CACHE_DIR" "${OUT:-/tmp/out}"
# Each cache comes back in parts of 15 MiB (a file back from $OUT may be 16 MiB at most: after a
# call that ran the llama bench the FlashInfer cache was larger and came back as nothing).
restore_cache() {  # restore_cache NAME DIR: .gpucache/NAME.tgz.* (parts, in order) unpacked into DIR
  compgen -G ".gpucache/$1.tgz.*" > /dev/null && cat ".gpucache/$1.tgz."* | tar xzf - -C "$2"
  true
}
restore_cache flashinfer "$HOME/.cache"
restore_cache triton "$HOME/.triton"
mstar() { python3 -m mstar.cli.mstar "$@"; }
started=$(date +%s)
elapsed() { echo $(( $(date +%s) - started )); }

save_caches() {  # the parts come back under $OUT (at most 8 files a call, 64 MiB together, and the
  # carried .whl plus .gpucache must stay under 64 MiB: drop the Triton parts first if they do not)
  [ -d "$HOME/.cache/flashinfer" ] && tar czf - -C "$HOME/.cache" flashinfer | split -b 15m - "$OUT/flashinfer.tgz."
  [ -d "$TRITON_CACHE_DIR" ] && tar czf - -C "$HOME/.triton" cache | split -b 15m - "$OUT/triton.tgz."
  ls -l "$OUT"/*.tgz.* 2>/dev/null
  true
}
