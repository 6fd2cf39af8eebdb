"""The Triton kernels, one family per file. Each file imports only torch and triton, so it
can be copied into another project on its own. Import them through ``ttx_tutorial`` (or set
``TRITON_INTERPRET=1`` yourself first) so that CPU-only machines get the interpreter."""
