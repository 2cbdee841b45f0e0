"""PFNM / NAFI fusion benchmark; the logic lives in fusekit.bench.fusion."""

from fusekit.bench.fusion import main

if __name__ == "__main__":
    raise SystemExit(main())
