"""pdserve: LLM serving with disaggregated prefill and decode tiers."""

import os as _os

__version__ = "0.1.0"

# The generated protobuf/gRPC stubs live next to their .proto files (proto/pdserve/v1) and are
# importable as pdserve.v1: the sub-package is found through this extra path entry.
__path__.append(_os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "proto", "pdserve"))
