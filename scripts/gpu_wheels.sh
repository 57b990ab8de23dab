#!/usr/bin/env bash
# Puts in wheels/ what scripts/gpu_check.sh needs on a GPU machine that reaches no package
# registry (Python 3.12, x86-64): msgspec and pyzmq (kvbridge's own dependencies that the
# machine's image lacks), the demo's transformers (the image's is older), NIXL (nixl-cu13
# 1.5.1) and Mooncake (its cuda13 0.3.14 transfer engine). The two engines' wheels are 56 and
# 47 MiB, over the 64 MiB a device call carries with the tree; what kvbridge never loads is
# dropped from copies of them (NIXL's expert-parallel kernels for three torch versions and
# UCX's perftest; Mooncake's store, master, client, collective and expert-parallel
# libraries), leaving about 53 MiB for all five.
#   scripts/gpu_wheels.sh && scripts/gpu_check.sh nixl mooncake    # (wheels/ travels: carry it)
set -eu
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
FULL="$(mktemp -d)"
trap 'rm -rf "$FULL"' EXIT
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64; do
    PLATFORMS+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$FULL" \
    msgspec pyzmq nixl-cu13==1.5.1 mooncake-transfer-engine-cuda13==0.3.14
mkdir -p wheels
mv "$FULL"/msgspec-*.whl "$FULL"/pyzmq-*.whl wheels/
# The demo's transformers (pyproject's demo extra pins it; pure Python, its needs are there).
tf=$(grep -o '"transformers==[0-9.]*"' pyproject.toml | tr -d '"')
python3 -m pip download -q --no-deps --only-binary=:all: -d wheels "$tf"
python3 - "$FULL" wheels <<'PYEOF'
import pathlib, re, sys, zipfile

DROP = {  # what kvbridge's transports never load, by wheel
    "nixl_cu13": [r"^nixl_ep_cu13/", r"perftest"],
    "mooncake_transfer_engine_cuda13": [
        r"_store\.cpython", r"libetcd_wrapper-", r"mooncake_client$", r"libmooncake_pg",
        r"mooncake_master$", r"_ep\.cpython", r"transfer_engine_bench$",
        r"libmooncake_ep_device", r"mooncake_ep_jit/", r"_pg_jit/",
    ],
}
full, out = map(pathlib.Path, sys.argv[1:])
for whl in sorted(full.glob("*.whl")):
    drop = [re.compile(p) for p in DROP[whl.name.split("-")[0]]]
    with zipfile.ZipFile(whl) as zi, zipfile.ZipFile(
        out / whl.name, "w", zipfile.ZIP_DEFLATED, compresslevel=9
    ) as zo:
        gone = {i.filename for i in zi.infolist() if any(p.search(i.filename) for p in drop)}
        for info in zi.infolist():
            if info.filename in gone:
                continue
            data = zi.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # the files that remain
                data = b"\n".join(
                    ln for ln in data.split(b"\n") if ln.split(b",")[0].decode() not in gone
                )
            zo.writestr(info, data)
    print(f"{whl.name}: {whl.stat().st_size >> 20} MiB -> {(out / whl.name).stat().st_size >> 20} MiB")
PYEOF
du -sh wheels
