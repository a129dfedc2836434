"""Makes python/ importable and keeps torch to one thread (the CI box is small)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass
