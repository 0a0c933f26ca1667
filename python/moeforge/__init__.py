"""moeforge: Mixture-of-Experts layers as algebra over tokens and experts,
computed under a schedule you choose, checked against an Eigen reference.

The algebra reads as in C++ with f[t, i] = ... for f(t, i) = ... (the README's
"Use it from Python and PyTorch" writes a whole layer). mf.evaluate(layer,
inputs) is the reference; mf.CpuLayer / mf.CpuTrainingLayer run the LLVM CPU
backend, mf.CudaTrainingLayer the GPU, moeforge.torch.MoELayer makes a
torch.nn.Module of a layer. Arrays go in as numpy arrays (or anything with
__dlpack__ in host memory) and come back as float64 numpy arrays. Mistakes
raise mf.UserError (a ValueError) with the message that says what to change.
"""

from ._core import *  # noqa: F401,F403
from ._core import UserError, __doc__ as _core_doc, __version__  # noqa: F401
