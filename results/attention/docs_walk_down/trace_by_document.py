import struct, sys
sys.path.insert(0,'/tmp/ra')
GHZ=1.65
def load(p):
    b=open(p,'rb').read(); n=struct.unpack('<q',b[:8])[0]
    v=struct.unpack('<%dQ'%(n*8), b[8:8+n*64]); return [v[i*8:(i+1)*8] for i in range(n)]
p, ntiles, order = sys.argv[1], int(sys.argv[2]), sys.argv[3]   # order: fo (k=in_chain) or kept (k = n-1-in_chain)
R=load(p)
lens=[32,128,8,256,64,16]; starts=[]; t=0; i=0
while t<ntiles: starts.append(t); t+=lens[i%6]; i+=1
import bisect
t0=min(r[0] for r in R)
agg={}
for bi,r in enumerate(R):
    chain, inc = bi//ntiles, bi%ntiles
    k = inc if order=='fo' else ntiles-1-inc
    d = bisect.bisect_right(starts,k)-1; L=(starts[d+1] if d+1<len(starts) else ntiles)-starts[d]; j=k-starts[d]
    key=(L, 'first8' if j<8 else 'rest')
    a=agg.setdefault(key,[0,0,0,0,0])
    dur=r[1]-r[0]; a[0]+=1; a[1]+=dur; a[2]+=r[6]/GHZ; a[3]+=r[2]/GHZ; a[4]+=r[7]&0xffffffff
for k in sorted(agg):
    a=agg[k]; print(f"doc tiles {k[0]:4d} {k[1]:7s} blocks {a[0]:5d} busy {a[1]/1e6:8.2f} ms  ns/step {a[1]/a[4]:6.0f}  empty-wait {a[2]/a[1]:.3f} count-wait {a[3]/a[1]:.3f}")
