"""Generated protobuf/gRPC stubs of the wire contract (`proto/splitserve/v1/*.proto`, package
`splitserve.v1`). Do not edit: regenerate with `python proto/generate.py`."""
