"""One run from start to end: start-up on every rank (launch), what the server and the
serial trainer share (session: model, optimizer, balancer, evaluator, log), the serial
trainer, evaluation, signals, progress, and `mpilb bench`.
"""
