"""CI: every file git tracks in the four packages is in the wheel (templates, alert rules,
migrations, py.typed), so a file left out of the package fails here, not at a user's.

    python .ci/package_check.py DIST.whl      (run from the checkout)
"""

from __future__ import annotations

import subprocess
import sys
import zipfile

PACKAGES = ("outbox", "relay", "consumer", "metrics")


def main(wheel: str) -> int:
    tracked = subprocess.run(
        ["git", "ls-files", *PACKAGES], capture_output=True, text=True, check=True
    ).stdout.split()
    with zipfile.ZipFile(wheel) as archive:
        packed = set(archive.namelist())
    missing = sorted(name for name in tracked if name not in packed)
    if missing:
        print(f"{len(missing)} tracked files are not in {wheel}:", file=sys.stderr)
        for name in missing:
            print(f"  {name}", file=sys.stderr)
        return 1
    print(f"the wheel holds all {len(tracked)} tracked files of {', '.join(PACKAGES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
