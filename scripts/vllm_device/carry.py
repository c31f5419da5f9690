"""Bring vLLM to the H200 machine in as few calls as it takes: wheels in, pieces out.

    python scripts/vllm_device/carry.py build      # download, stage, prune, pack, split
    python scripts/vllm_device/carry.py split      # the same stream in pieces for today's tree
    python scripts/vllm_device/carry.py plan       # each call's carry list and command

`build` (here, with pip and network):
  1. downloads every wheel of wheels.txt (exact versions, no dependencies, for CPython 3.12 on
     manylinux x86-64) into .whl/wheels/ (git-ignored), skipping those already there;
  2. installs them without dependencies into .whl/stage/ (what the device's Python will import);
  3. drops what vLLM never loads on an H200 for this work (DROP below), and blanks, in every
     shared library, the GPU code a compute-capability-9.0 device cannot load
     (fatbin_prune.py);
  4. packs the stage as one tar.xz stream and splits it into the fewest pieces of one size that
     fit one call each beside the working tree, .whl/carry/<k>/piece, with manifest.json
     (sha256 of each piece and of the whole). `split` does step 4's split again, in seconds,
     when the tree has grown since (committed measurements travel with every call).

`plan` prints, per piece, the `carry` list and the device command. Each command keeps its piece
in /root/vllm-carry/ (outside the working-tree copy) and, once every piece is there and its
checksum holds, unpacks them into /root/vllm-site/; a command run again does nothing it did
before. The last piece's command also checks `import vllm`. Every command first prints what is
already installed, so a call after a failed one shows where it stands.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
WHL = ROOT / ".whl"
WHEELS, STAGE, CARRY = WHL / "wheels", WHL / "stage", WHL / "carry"
SITE, KEEP = "/root/vllm-site", "/root/vllm-carry"
MIB = 1 << 20
CALL_LIMIT = 64 * MIB          # what one call may carry, the working tree included
MARGIN = 2 * MIB               # for files others add to the tree before the calls

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]

# Members of the stage that vLLM does not load on an H200 serving a bf16 Llama (README.md:
# what each is and how that was checked).
DROP = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",   # FA2: sm_80 code only; Hopper runs FA3, and
                                                  # vLLM imports FA2 inside try/except
    "vllm/vllm-rs",                               # the Rust front end, opt-in
    "vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so",   # other Pythons
    "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so",
    "bin",                                        # console scripts with this machine's shebang
]


def wheel_list() -> list[str]:
    lines = (HERE / "wheels.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def _platform_args() -> list[str]:
    out = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for p in PLATFORMS:
        out += ["--platform", p]
    return out


def download() -> None:
    WHEELS.mkdir(parents=True, exist_ok=True)      # pip skips the wheels already there
    _pip("download", "-q", "--no-deps", *_platform_args(), "-d", str(WHEELS), *wheel_list())


def stage() -> None:
    if STAGE.exists():
        shutil.rmtree(STAGE)
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    names = {Path(w).name.split("-")[0].lower() for w in wheels}
    if len(names) != len(wheels):
        raise SystemExit(f"{WHEELS}: two versions of one package; keep one")
    _pip("install", "-q", "--no-deps", "--no-compile", "--no-index", "--target", str(STAGE),
         *_platform_args(), *wheels)


def prune() -> dict:
    sys.path.insert(0, str(HERE))
    from fatbin_prune import prune as prune_fatbins
    for member in DROP:
        path = STAGE / member
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    freed = 0
    for lib in sorted(STAGE.rglob("*.so*")):
        data = lib.read_bytes()
        if b"\x50\xed\x55\xba" not in data:
            continue
        out, stats = prune_fatbins(data, 90)
        if stats["freed_bytes"]:
            lib.write_bytes(out)
            freed += stats["freed_bytes"]
            print(f"  {lib.relative_to(STAGE)}: {stats}", file=sys.stderr)
    return {"fatbin_bytes_freed": freed}


def _tree_bytes() -> int:
    """What every call sends besides its piece: tracked and untracked, not ignored, files."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names
               if n and (ROOT / n.decode()).is_file())


def pack() -> dict:
    tarball = WHL / "vllm-site.tar.xz"
    plain = WHL / "vllm-site.tar"
    with tarfile.open(plain, "w") as tar:
        for path in sorted(STAGE.rglob("*")):
            info = tar.gettarinfo(str(path), str(path.relative_to(STAGE)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if info.isfile():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    tarball.unlink(missing_ok=True)
    subprocess.run(["xz", "-9", "-T0", str(plain)], check=True)      # -> vllm-site.tar.xz
    return split()


def split() -> dict:
    """Split the packed stream into the fewest pieces that fit a call beside the working tree,
    all of one size, so that the tree may grow by several MiB before the pieces stop fitting."""
    data = (WHL / "vllm-site.tar.xz").read_bytes()
    tree = _tree_bytes()
    room = CALL_LIMIT - tree - MARGIN
    if room <= 0:
        raise SystemExit(f"the working tree ({tree / MIB:.1f} MiB) leaves no room for a piece")
    count = -(-len(data) // room)
    piece = -(-len(data) // count)
    if CARRY.exists():
        shutil.rmtree(CARRY)
    pieces = []
    for k, start in enumerate(range(0, len(data), piece), start=1):
        folder = CARRY / str(k)
        folder.mkdir(parents=True)
        chunk = data[start:start + piece]
        (folder / "piece").write_bytes(chunk)
        pieces.append({"k": k, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"tar_xz_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "tree_bytes": tree, "piece_bytes": piece, "pieces": pieces,
                "wheels": wheel_list()}
    (CARRY / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def device_command(k: int, manifest: dict, then: str = "") -> str:
    """The shell command for the call that carries piece k (idempotent)."""
    n, whole = len(manifest["pieces"]), manifest["sha256"]
    sha = manifest["pieces"][k - 1]["sha256"]
    done = f"{SITE}/.complete-{whole[:16]}"
    cmd = (
        f"set -o pipefail; mkdir -p {KEEP} {SITE}; T0=$(date +%s); "
        f"ls {KEEP}; [ -f {done} ] && echo 'site complete'; "
        f"if [ ! -f {done} ] && ! echo '{sha}  {KEEP}/{k:02d}' | sha256sum -c --status; then "
        f"cp .whl/carry/{k}/piece {KEEP}/{k:02d} && "
        f"echo '{sha}  {KEEP}/{k:02d}' | sha256sum -c || exit 3; fi; "
        f"if [ ! -f {done} ] && [ $(ls {KEEP} | wc -l) -ge {n} ]; then "
        f"cat $(ls -d {KEEP}/* | sort) | tee >(sha256sum >&2) | xz -dc -T0 | tar -x -C {SITE} "
        f"&& touch {done} && rm -rf {KEEP}; fi; "
        f"echo piece {k}/{n} in $(( $(date +%s) - T0 )) s; "
    )
    if k == n:
        cmd += (f"[ -f {done} ] || exit 4; export PYTHONPATH={SITE}:$PWD; "
                "PYTHONUNBUFFERED=1 python3 -c 'import vllm, torch; print(\"vllm\", "
                "vllm.__version__, \"torch\", torch.__version__)' 2>&1 | tail -3; ")
    return cmd + then


def plan() -> None:
    manifest = json.loads((CARRY / "manifest.json").read_text())
    n = len(manifest["pieces"])
    print(f"{n} calls; pack {manifest['tar_xz_bytes'] / MIB:.1f} MiB; working tree "
          f"{manifest['tree_bytes'] / MIB:.1f} MiB; pieces of {manifest['piece_bytes'] / MIB:.1f}"
          " MiB")
    for p in manifest["pieces"]:
        print(f"\n# call {p['k']}/{n}\ncarry: [\".whl/carry/{p['k']}\"]\ncommand: "
              f"{device_command(p['k'], manifest)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["build", "split", "plan"])
    args = ap.parse_args(argv)
    if args.step == "build":
        timings = {}
        for name, step in (("download", download), ("stage", stage), ("prune", prune),
                           ("pack", pack)):
            t0 = time.perf_counter()
            step()
            timings[name] = round(time.perf_counter() - t0, 1)
            print(f"[carry] {name}: {timings[name]} s", file=sys.stderr, flush=True)
        plan()
    elif args.step == "split":      # the packed stream again, for a working tree that has grown
        split()
        plan()
    else:
        plan()
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
