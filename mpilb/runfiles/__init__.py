"""The files a run leaves: the run log (runlog), its summary (summary), checkpoints,
reports and plots, export to plain PyTorch, TensorBoard scalars, and the names of it all
(paths, files).
"""
