"""runfiles"""
