"""pyhvp: structured second-order derivatives of PyTorch functions (CPU and CUDA).

Public names only; each operator lives in its own module.
"""

from pyhvp.backends import Backend, BackendUnavailableError, available_backends
from pyhvp.backends.julia import JuliaBackendError, JuliaFunction, julia_function
from pyhvp.backends.torch import TorchBackend
from pyhvp.bilaplacian import bilaplacian
from pyhvp.diagonal import hessian_diagonal
from pyhvp.differential_operator import differential_operator
from pyhvp.directional import directional_derivatives
from pyhvp.hvp import grad_and_hvp, hvp
from pyhvp.instances import InstanceCouplingError, PerInstance, check_instances, per_instance
from pyhvp.kronecker import KroneckerHVP
from pyhvp.laplacian import GradAndLaplacian, grad_and_laplacian, laplacian
from pyhvp.submatrix import module_loss, sub_hessian
from pyhvp.taylor import InPlaceInputError, UnsupportedOpError, register_jet_rule

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "GradAndLaplacian",
    "InPlaceInputError",
    "InstanceCouplingError",
    "JuliaBackendError",
    "JuliaFunction",
    "KroneckerHVP",
    "PerInstance",
    "TorchBackend",
    "UnsupportedOpError",
    "available_backends",
    "bilaplacian",
    "check_instances",
    "differential_operator",
    "directional_derivatives",
    "grad_and_hvp",
    "grad_and_laplacian",
    "hessian_diagonal",
    "hvp",
    "julia_function",
    "laplacian",
    "module_loss",
    "per_instance",
    "register_jet_rule",
    "sub_hessian",
]
