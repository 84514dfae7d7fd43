"""Decode: the token loop (`decoder`), one step's forward (`step`), and decode steps of several requests
as one batch (`batching`)."""
