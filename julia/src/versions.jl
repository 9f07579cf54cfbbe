"""
    versions()

What `python -m pyhvp.check_julia` reports about this Julia, as `(name, version)` pairs of
strings: Julia, the packages PyHVP loads, and the CUDA version the driver supports (or why
there is none). Calls `CUDA.functional()`, which initializes CUDA where a GPU exists.
"""
function versions()
    driver = CUDA.functional() ? string(CUDA.driver_version()) : "none (CUDA.functional() is false)"
    return (
        ("Julia", string(VERSION)),
        ("Enzyme", string(pkgversion(Enzyme))),
        ("CUDA.jl", string(pkgversion(CUDA))),
        ("DLPack.jl", string(pkgversion(DLPack))),
        ("ForwardDiff", string(pkgversion(ForwardDiff))),
        ("CUDA driver", driver),
    )
end
