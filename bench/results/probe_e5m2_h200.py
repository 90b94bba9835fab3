"""Which FP8 dtype pairs torch._scaled_mm (rowwise scales) and torch._scaled_grouped_mm accept on this GPU."""
import torch
dev = "cuda"
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
M, K, N = 256, 512, 384
a = torch.randn(M, K, device=dev)
b = torch.randn(N, K, device=dev)
for da, db in ((E4, E4), (E5, E4), (E4, E5), (E5, E5)):
    try:
        y = torch._scaled_mm(a.to(da), b.to(db).t(), torch.ones(M, 1, device=dev), torch.ones(1, N, device=dev),
                             out_dtype=torch.bfloat16)
        ref = a.to(da).float() @ b.to(db).float().t()
        print(f"_scaled_mm rowwise {da} x {db}: ok, max rel err {(y.float()-ref).abs().max()/ref.abs().max():.2e}")
    except Exception as e:
        print(f"_scaled_mm rowwise {da} x {db}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
G = 4
offs = torch.tensor([64, 128, 192, 256], device=dev, dtype=torch.int32)
w = torch.randn(G, N, K, device=dev)
for da, db in ((E4, E4), (E5, E4), (E4, E5)):
    try:
        y = torch._scaled_grouped_mm(a.to(da), w.to(db).transpose(-2, -1), torch.ones(M, device=dev),
                                     torch.ones(G, N, device=dev), offs, out_dtype=torch.bfloat16)
        print(f"_scaled_grouped_mm {da} x {db}: ok")
    except Exception as e:
        print(f"_scaled_grouped_mm {da} x {db}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
