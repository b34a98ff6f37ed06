"""The recipe's dtype names (model.dtype, engine.mixed_precision, engine.reduce_dtype) as torch dtypes: the one
table every reader of those keys uses."""
import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}  # and back: a torch dtype's recipe name
