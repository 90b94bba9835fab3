"""The lightning_moe benchmark suites (GPU, on the device machine; never in CI).

``python -m bench --list`` lists the suites, ``python -m bench <suite> [options]`` runs one (``--help`` for its
options), ``python -m bench results`` regenerates the tables of bench/RESULTS.md from the result files. See
bench/README.md.
"""
