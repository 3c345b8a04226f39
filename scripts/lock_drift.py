"""Lists the installed versions that differ from a lock: `pip freeze | python scripts/lock_drift.py LOCK`.

`.ci/run --latest` prints it before the tests, so a failure there names the releases that are new since the lock.
"""

from __future__ import annotations

import sys

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name


def pins(lines) -> dict[str, str]:
    """``name -> version`` for every ``name==version`` line (comments, markers and options skipped)."""
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            found[canonicalize_name(req.name)] = exact[0]
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        locked = pins(f)
    installed = pins(sys.stdin)
    rows = [f"  {name}: {locked.get(name, '(not in the lock)')} -> {version}"
            for name, version in sorted(installed.items()) if locked.get(name) != version]
    rows += [f"  {name}: {version} -> (not installed)" for name, version in sorted(locked.items())
             if name not in installed]
    print("\n".join(rows) if rows else "  none")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
