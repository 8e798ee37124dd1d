# Sourced by the one-GPU check scripts: the NVLink-multicast variables off, unbuffered output, the output
# folder ($1, else $OUT, else ./out) in $out, this checkout on PYTHONPATH, $py and a $status to return.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${1:-${OUT:-out}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
status=0

# pack_logs: everything in $out into $out/logs.tar.gz (the device tool returns at most 8 files); the archive
# is built in a hidden folder inside $out, so two runs never share a path
pack_logs() {
  local pack="$out/.pack.$$"
  mkdir -p "$pack" && tar czf "$pack/logs.tar.gz" --exclude="./.pack.$$" -C "$out" . &&
    find "$out" -mindepth 1 -maxdepth 1 ! -name ".pack.$$" -exec rm -rf {} + && mv "$pack/logs.tar.gz" "$out/" &&
    rmdir "$pack"
}
