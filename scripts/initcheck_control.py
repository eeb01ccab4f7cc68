"""Control for compute-sanitizer initcheck (scripts/verify_gpu.sh): plain PyTorch only, no
dqn_ops. A BF16 x BF16 -> F32 cuBLAS GEMM of the forward's shapes into a fresh tensor, whose
every element a torch kernel then reads. If initcheck reports reads of uninitialised memory
here, it does not see the writes of cuBLAS's Hopper GEMM kernels (TMA stores), and the same
report for a dqn_ops kernel reading a GEMM's output is that blind spot, not a bug."""
import torch


def main():
    torch.manual_seed(0)
    for rows, k, n in [(33, 37, 61), (256, 96, 256), (256, 256, 512), (512, 256, 512)]:
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        y = a @ w.t()  # cuBLAS writes every element of y
        z = y.float() + 1.0  # a torch elementwise kernel reads every element of y
    torch.cuda.synchronize()
    print("initcheck_control: done", float(z.sum()))


if __name__ == "__main__":
    main()
