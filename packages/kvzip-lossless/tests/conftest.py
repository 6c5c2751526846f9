import os

import torch

# CPU twins of the GPU kernels run under the Triton interpreter; on a CUDA machine the
# compiled kernels run instead (tests marked gpu).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
