"""Parse (and print) time of the largest committed HLO fixtures.

    python -m bench.compile.parse [--repeat 7]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

from stitch.hlo import parse_hlo, print_hlo
from hlo_fixtures import zoo_fixture_files


def measure(text: str, repeat: int) -> tuple[float, float]:
    parse_times, print_times = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        module = parse_hlo(text)
        parse_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        print_hlo(module)
        print_times.append(time.perf_counter() - start)
    return statistics.median(parse_times), statistics.median(print_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--top", type=int, default=8, help="how many of the largest fixtures")
    args = parser.parse_args()
    files = sorted(zoo_fixture_files(), key=lambda p: p.stat().st_size, reverse=True)[:args.top]
    bert = [p for p in zoo_fixture_files() if p.parent.name == "bert_layer_train" and p.name.startswith("full.gpu")]
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print("| fixture | size (KiB) | lines | parse (ms, median) | print (ms, median) |")
    print("|---|---:|---:|---:|---:|")
    for path in dict.fromkeys(bert + files):
        text = path.read_text()
        parse_s, print_s = measure(text, args.repeat)
        print(f"| {path.parent.name}/{path.name} | {len(text) / 1024:.0f} | {text.count(chr(10))} "
              f"| {parse_s * 1e3:.1f} | {print_s * 1e3:.1f} |")


if __name__ == "__main__":
    main()
