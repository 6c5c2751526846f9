"""csrc/kvzl.cu as C++ for the CPU emulation in emu.h: each ``k<<<grid, block, smem, s>>>(...)``
becomes ``emu_launch(k, dim3(grid), dim3(block), (smem), ...)``, and ``extern __shared__ T x[];``
the block's dynamic shared buffer. Usage: to_cpp.py kvzl.cu > out.cpp"""

import re
import sys


def convert(src: str) -> str:
    out, i = [], 0
    while (j := src.find("<<<", i)) >= 0:
        name = re.search(r"(\w+)\s*$", src[:j])
        out.append(src[i : name.start()])
        e = src.find(">>>", j)
        parts, depth, cur = [], 0, ""
        for ch in src[j + 3 : e]:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += (ch == "(") - (ch == ")")
            cur += ch
        parts.append(cur)
        if src[e + 3] != "(":
            raise ValueError("unexpected launch syntax")
        smem = parts[2] if len(parts) > 2 else "0"
        out.append(f"emu_launch({name.group(1)}, dim3({parts[0]}), dim3({parts[1]}), ({smem}), ")
        i = e + 4
    out.append(src[i:])
    text = "".join(out).replace("#include <cuda_runtime.h>", "")
    # dynamic shared memory: the block's buffer, sized by the launch's third argument
    text = re.sub(r"extern __shared__ (\w+) (\w+)\[\];", r"\1* \2 = (\1*)emu_dynamic_smem();", text)
    return '#include "emu.h"\n' + text


if __name__ == "__main__":
    print(convert(open(sys.argv[1]).read()))
