"""Write the tiny GGUF files of test_device_models.py into a folder, on a machine with the pinned
transformers (tests/hf_version.py). With MGSERVE_TEST_TINY naming that folder, the device tests
read these files instead of exporting with the GPU machine's own transformers, so they run there
whatever its version (run_on_device.sh sets it when the folder travels as .tiny/, ~50 MB).

    PYTHONPATH=$PWD python3 -m tests.cuda.export_tiny .tiny
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.cuda.test_device_models import ARCHS, _export


def main(folder: str) -> None:
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        path = _export(arch, root)
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".tiny")
