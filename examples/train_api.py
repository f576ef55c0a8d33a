"""Train the digits CNN from Python (the API), then use the trained module in plain torch.

    mpilb prepare digits digits
    mpiexec -n 4 python examples/train_api.py digits
"""
import sys

import mpilb
from torch_cnn import Net

summary = mpilb.train(model=Net, data=sys.argv[1], epochs=int(sys.argv[2]) if len(sys.argv) > 2 else 20,
                      log="api.h5", checkpoint="api.ckpt.h5", progress=False)
if summary is not None:   # rank 0; the other ranks get None
    print(f"test accuracy {summary['final_test_accuracy']:.4f}, coverage {summary['coverage']}")
    net = mpilb.load("api.ckpt.h5", model=Net)   # a torch.nn.Module with the trained weights
    print(type(net).__name__, sum(p.numel() for p in net.parameters()), "parameters")
