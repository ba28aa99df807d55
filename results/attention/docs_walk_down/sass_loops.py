# The long backward branches (loops) of the fused dK/dV kernels in two `cuobjdump -sass` dumps,
# with their lengths in instructions: the consumers' step loop is the first, about 570 long.
#   python3 sass_loops.py main.sass cand.sass
import re, sys

def kernels(path):
    out = {}
    for part in re.split(r'\n\s+Function : ', open(path).read())[1:]:
        name = part.split('\n')[0].strip()
        out[name] = [(int(m.group(1), 16), m.group(2).strip()) for m in
                     (re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);', l) for l in part.split('\n')) if m]
    return out

for path, key in zip(sys.argv[1:], ('dkdv_kernelILb1ELb0', 'dkdv_kernelILb1ELb1')):
    found = kernels(path)
    name = next(n for n in found if key in n)
    print(path, name[:48], len(found[name]), 'instructions')
    for addr, ins in found[name]:
        m = re.search(r'BRA.*?0x([0-9a-f]+)', ins)
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > 0x400:
            print(f'  loop {int(m.group(1), 16):#x}..{addr:#x}: {(addr - int(m.group(1), 16)) // 16} instructions  {ins}')
