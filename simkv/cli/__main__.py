"""`python -m simkv.cli ...`: the same command as `simkv ...`."""
from simkv.cli import main

main()
