import os
import sys

# Development stand-in while kvzip_lossless's codec lands (removed once it has compress).
if os.environ.get("KVZIP_LOSSLESS_STANDIN"):
    sys.path.insert(0, "/tmp/kvw")
    exec(open("/tmp/kvw/standin.py").read())
