"""``python benchmarks/transfer.py [options]``: the same as ``kvbridge bench transfer``.

A request moved between real processes over each transport, next to memcpy; see
benchmarks/README.md. Options: ``--help``.
"""

from kvbridge.cli.bench import bench_transfer

if __name__ == "__main__":  # the guard matters: rank processes are spawned, re-importing this
    bench_transfer()
