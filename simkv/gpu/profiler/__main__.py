"""`python -m simkv.gpu.profiler`: profile, and with --fit fit the result.

simkv.fitting sits above simkv.gpu, so only this command (not a layer) joins the two."""
import sys

from simkv.gpu.profiler.command import main


def fit_profile(profile_dir):
    from simkv.fitting.fit import fit_profile as fit
    return fit(profile_dir)


sys.exit(main(fit_profile=fit_profile))
