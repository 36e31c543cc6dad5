"""Start-up: seconds from `prefixserve serve` (README's command) to its first chat answer, and, in the same run,
the part of it the model's load takes in one process (GGUF parse, dequantization, model build) with prefixserve's
GGUF reader against gguf's GGUFReader and gguf.quants.dequantize (the load before 2026-11-28).

    python benchmarks/bench_startup.py [--rounds 3] [--port 8000] [--baseline CHECKOUT]

Each round starts a fresh server (its own Ray cluster) and stops it with SIGINT; the loads run in fresh
subprocesses, one at a time, while no server runs. --baseline: also serve from another checkout of prefixserve
(`git worktree add /tmp/base COMMIT`), put ahead of the installed one on PYTHONPATH, alternating rounds with this one.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve_vs_vllm import stop_session  # noqa: E402

LOAD = """
import time, sys
if sys.argv[1] == "gguf":
    import gguf
    from replica.executor import gguf_file
    def read(path):
        reader = gguf.GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
        return gguf_file.GGUFFile(metadata, [gguf_file.GGUFTensor(t.name, t.tensor_type, t.data)
                                             for t in reader.tensors])
    gguf_file.read_gguf = read
    import replica.executor.gguf_loader as loader
    loader.read_gguf = read
    loader.dequantize = lambda tensor: gguf.quants.dequantize(tensor.data, tensor.tensor_type)
from replica.engine import LLM
start = time.perf_counter()
LLM(dtype="float32")
print(time.perf_counter() - start)
"""


def time_to_first_answer(port: int, checkout: str | None = None, timeout_s: float = 300) -> float:
    env = os.environ | ({"PYTHONPATH": checkout} if checkout else {})
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--port", str(port)], stdout=log,
                                   stderr=log, start_new_session=True, env=env, cwd=checkout)
        try:
            while time.monotonic() - start < timeout_s:
                if process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read().decode()[-3000:]}")
                try:
                    # a short timeout: Serve's proxy may hold a request sent before the app is ready for long
                    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=2, json={
                        "model": "SmolLM2-135M-Instruct", "max_tokens": 1,
                        "messages": [{"role": "user", "content": "Hi"}]})
                    if response.status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
            raise TimeoutError(f"no answer in {timeout_s:.0f} s")
        finally:
            stop_session(process)


def load_seconds(reader: str) -> float:
    result = subprocess.run([sys.executable, "-c", LOAD, reader], capture_output=True, text=True, check=True)
    return float(result.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--baseline", help="a checkout of another commit to serve from, for comparison")
    args = parser.parse_args()
    served, baseline = [], []
    for _ in range(args.rounds):
        served.append(time_to_first_answer(args.port))
        if args.baseline:
            baseline.append(time_to_first_answer(args.port, args.baseline))
    ours = [load_seconds("prefixserve") for _ in range(args.rounds)]
    theirs = [load_seconds("gguf") for _ in range(args.rounds)]
    print(f"prefixserve serve to first chat answer: {', '.join(f'{s:.1f}' for s in served)} s "
          f"(median {statistics.median(served):.1f})")
    if baseline:
        print(f"the same from {args.baseline}: {', '.join(f'{s:.1f}' for s in baseline)} s (median "
              f"{statistics.median(baseline):.1f}); ratio of medians {statistics.median(baseline) / statistics.median(served):.2f}x")
    print(f"model load in one process (LLM(), float32), prefixserve's GGUF reader: "
          f"{', '.join(f'{s:.1f}' for s in ours)} s; gguf's reader and dequantize: "
          f"{', '.join(f'{s:.1f}' for s in theirs)} s; "
          f"ratio of medians {statistics.median(theirs) / statistics.median(ours):.2f}x")


if __name__ == "__main__":
    main()
