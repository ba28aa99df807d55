import struct, sys, statistics as st
GHZ=1.65
def load(p):
    b=open(p,'rb').read(); n=struct.unpack('<q',b[:8])[0]
    v=struct.unpack('<%dQ'%(n*8), b[8:8+n*64])
    return [v[i*8:(i+1)*8] for i in range(n)]
for p in sys.argv[1:]:
    R=load(p); t0=min(r[0] for r in R); t1=max(r[1] for r in R)
    span=t1-t0
    steps=sum(r[7]&0xffffffff for r in R)
    busy=sum(r[1]-r[0] for r in R)
    cyc=lambda k: sum(r[k] for r in R)/GHZ
    print(f"{p.split('/')[-1]:18s} blocks {len(R)} span {span/1e6:.2f} ms, SM-occupancy {busy/(span*132):.3f}, ns/step {busy/steps:.0f}"
          f" | adder: count-wait {cyc(2)/busy:.3f} full-wait {cyc(3)/busy:.3f} perf-wait {cyc(4)/busy:.3f} | cons0: load-wait {cyc(5)/busy:.3f} empty-wait {cyc(6)/busy:.3f}")
