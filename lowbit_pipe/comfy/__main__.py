"""`python -m lowbit_pipe.comfy install /path/to/ComfyUI`: see lowbit_pipe.comfy.install."""

from lowbit_pipe.comfy.install import main

raise SystemExit(main())
