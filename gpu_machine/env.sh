# Source ON the device (`source gpu_machine/env.sh`) at the start of every call after the install: the carried packages
# live in /tmp/site (kept while the machine stays warm), the project is the repo root that travels with each call.
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export E3R_SITE="${E3R_SITE:-/tmp/site}"
export PYTHONPATH="$E3R_SITE:$_repo${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$E3R_SITE/bin:$PATH"
export PYTHONUNBUFFERED=1
# A process that touches CUDA before vllm.LLM (the benches) fails with "Cannot re-initialize CUDA in forked
# subprocess" under fork; inside Ray actors vLLM picks spawn itself.
export VLLM_WORKER_MULTIPROC_METHOD=spawn
# No flashinfer-cubin is carried: vLLM's flashinfer sampler would need it.
export VLLM_USE_FLASHINFER_SAMPLER=0
# NVLink multicast stays off on multi-GPU hosts: keep these, also for child processes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Nothing outside the machine can be reached: no hub look-ups, no usage reports.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0
export TOKENIZERS_PARALLELISM=false
# Compile caches under /tmp survive between calls while the machine is warm, so later engines start faster.
export VLLM_CACHE_ROOT=/tmp/vllm_cache TRITON_CACHE_DIR=/tmp/triton_cache
unset _repo
