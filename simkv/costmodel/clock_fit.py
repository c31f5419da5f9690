"""Renamed: the clock fit is `simkv fit clock` (simkv.fitting.clock). This alias keeps
`python -m simkv.costmodel.clock_fit ARGS` working for one release."""

if __name__ == "__main__":
    import sys

    from simkv.fitting.clock import main
    print("note: python -m simkv.costmodel.clock_fit is renamed: simkv fit clock",
          file=sys.stderr)
    sys.exit(main())
