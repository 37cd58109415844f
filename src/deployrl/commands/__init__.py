"""The `deployrl` commands (dispatched by `deployrl.cli`): train, eval, mismatch, selfcheck and bench.
Each is a `main(argv)` on top of the library; nothing below imports from here."""
