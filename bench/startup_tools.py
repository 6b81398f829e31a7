"""Start-up of the looking tools: `mosaicd status --help`, `mosaicd --help`, `mosaicd --version` and
`mosaicd runs` against `python -c "import aiohttp"` (issue #23's yardstick: <= 1.5x), each a fresh process.

Wall time per command, the best (minimum) of --repeat runs, since a busy machine only ever adds time; the
ratio is the command's over aiohttp's import. Also the heavy modules each command imports (none expected).

    .venv/bin/python bench/startup_tools.py               # about 10 s
    .venv/bin/python bench/startup_tools.py --repeat 10

Last line of stdout: a JSON object {"aiohttp_s", "commands": {name: {"s", "ratio", "heavy"}}, "ratio"} where
"ratio" is `mosaicd status --help`'s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HEAVY = ("aiohttp", "numpy", "pydantic", "torch", "structlog", "matplotlib")
COMMANDS = {"status --help": ["status", "--help"], "--help": ["--help"], "--version": ["--version"],
            "runs": ["runs", "{tmp}"]}


def best_of(argv: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=False, timeout=120)
        times.append(time.perf_counter() - started)
    return min(times)


def heavy_imports(args: list[str]) -> list[str]:
    """The HEAVY modules `mosaicd ARGS` imports (run in a fresh interpreter, which then prints sys.modules)."""
    code = (f"import sys\nfrom mosaicd.cli import main\ntry:\n    main({args!r})\nexcept SystemExit:\n    pass\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(done.stderr.strip().splitlines()[-1].replace("'", '"'))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (the best is kept)")
    args = parser.parse_args()
    mosaicd = [sys.executable, "-m", "mosaicd"] if not (Path(sys.executable).parent / "mosaicd").exists() \
        else [str(Path(sys.executable).parent / "mosaicd")]
    with tempfile.TemporaryDirectory(prefix="mosaic-tools-") as tmp:
        aiohttp_s = best_of([sys.executable, "-c", "import aiohttp"], args.repeat)
        print(f"{'command':28s} {'best s':>7} {'/ aiohttp':>9}  heavy imports")
        yardstick = 'python -c "import aiohttp"'
        print(f"{yardstick:28s} {aiohttp_s:7.3f} {1.0:9.2f}")
        results: dict[str, Any] = {}
        for name, argv in COMMANDS.items():
            argv = [a.replace("{tmp}", tmp) for a in argv]
            seconds = best_of([*mosaicd, *argv], args.repeat)
            heavy = heavy_imports(argv)
            results[name] = {"s": round(seconds, 3), "ratio": round(seconds / aiohttp_s, 2), "heavy": heavy}
            print(f"{'mosaicd ' + name:28s} {seconds:7.3f} {seconds / aiohttp_s:9.2f}  {', '.join(heavy) or '-'}")
    print(json.dumps({"aiohttp_s": round(aiohttp_s, 3), "commands": results,
                      "ratio": results["status --help"]["ratio"]}))


if __name__ == "__main__":
    main()
