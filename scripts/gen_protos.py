"""Generate the Python modules of protos/tokenfeed/v1/*.proto (`make protos`).

    python scripts/gen_protos.py [OUT_DIR]

OUT_DIR defaults to protos/ (the committed modules); tests pass a temporary folder
and compare bytes, so the committed code provably matches the .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTOS.glob("tokenfeed/v1/*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    for proto in protos:
        rel = proto.relative_to(PROTOS).as_posix()
        args = [
            "protoc",
            f"-I{PROTOS}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            rel,
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {rel}")
    return sorted(p for p in out_dir.glob("tokenfeed/v1/*_pb2*") if p.suffix in (".py", ".pyi"))


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTOS
    for path in generate(out):
        print(path)
