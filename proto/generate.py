"""Regenerate the Python gRPC code from proto/*.proto (the one command: `make proto`).

protoc's virtual path `tierstack/proto=proto` makes the generated modules import each
other as `tierstack.proto.X`, which is where the package maps this directory.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def generate(out_dir: Path) -> list[Path]:
    """Generate into `out_dir` (flat); returns the files written."""
    with tempfile.TemporaryDirectory() as tmp:
        protos = sorted(PROTO_DIR.glob("*.proto"))
        args = ["protoc", f"--proto_path=tierstack/proto={PROTO_DIR}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
        args += [f"tierstack/proto/{p.name}" for p in protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed; see the message above")
        written = []
        for f in sorted((Path(tmp) / "tierstack" / "proto").iterdir()):
            shutil.copy(f, out_dir / f.name)
            written.append(out_dir / f.name)
        return written


if __name__ == "__main__":
    for path in generate(PROTO_DIR):
        print(f"wrote {path.relative_to(PROTO_DIR.parent)}", file=sys.stderr)
