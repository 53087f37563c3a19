// What a machine allows two processes sharing one GPU (the --share-gpu
// tests): a buffer shared through CUDA IPC, and the round-trip time of a flag
// between the processes, by SM stores and by a copy-engine copy plus
// cuStreamWriteValue32, each answered by a one-thread wait kernel. Without
// MPS the two processes' kernels take turns on the GPU, so a round trip
// lasts a time slice. Prints one JSON line per rank and probe.
//
//   nvcc -O2 -arch=sm_90 -cudart static -o ipc_probe scripts/ipc_probe.cu
//   ./ipc_probe [sm round trips] [copy-engine round trips]
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "rank %d: %s failed: %s\n", rank, #x, cudaGetErrorString(e)); exit(2);} } while (0)

__device__ unsigned long long Now() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__device__ unsigned Ld(const unsigned* p) { unsigned v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ void St(unsigned* p, unsigned v) { asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }

// SM ping-pong: rank 0 sends i, waits for i back; rank 1 echoes.
__global__ void PingPong(unsigned* mine, unsigned* peer, int rank, int iters, unsigned long long timeout_ns, int* done) {
  unsigned long long t0 = Now();
  for (int i = 1; i <= iters; ++i) {
    if (rank == 0) St(peer, i);
    while (Ld(mine) < (unsigned)i) { if (Now() - t0 > timeout_ns) { *done = -i; return; } }
    if (rank == 1) St(peer, i);
  }
  *done = iters;
}
__global__ void WaitFlag(const unsigned* f, unsigned v, unsigned long long timeout_ns, int* bad) {
  unsigned long long t0 = Now();
  while (Ld(f) < v) { if (Now() - t0 > timeout_ns) { *bad = 1; return; } }
}

typedef CUresult (*WriteValueFn)(CUstream, CUdeviceptr, cuuint32_t, unsigned);

int main(int argc, char** argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 200;
  int ce_iters = argc > 2 ? atoi(argv[2]) : 50;
  int p01[2], p10[2], res[2];
  if (pipe(p01) || pipe(p10) || pipe(res)) return 1;
  pid_t kids[2];
  for (int rank = 0; rank < 2; ++rank) {
    kids[rank] = fork();
    if (kids[rank]) continue;
    CK(cudaSetDevice(0));
    unsigned* buf; CK(cudaMalloc(&buf, 1 << 20)); CK(cudaMemset(buf, 0, 1 << 20)); CK(cudaDeviceSynchronize());
    cudaIpcMemHandle_t h; CK(cudaIpcGetMemHandle(&h, buf));
    int wfd = rank == 0 ? p01[1] : p10[1], rfd = rank == 0 ? p10[0] : p01[0];
    if (write(wfd, &h, sizeof h) != sizeof h) exit(3);
    cudaIpcMemHandle_t ph; if (read(rfd, &ph, sizeof ph) != sizeof ph) exit(3);
    void* peer_raw = nullptr; CK(cudaIpcOpenMemHandle(&peer_raw, ph, cudaIpcMemLazyEnablePeerAccess));
    unsigned* peer = (unsigned*)peer_raw;
    int* done; CK(cudaMallocManaged(&done, 8)); *done = 0;
    // sync the two processes through the pipes
    char c = 1; write(wfd, &c, 1); read(rfd, &c, 1);
    auto t0 = std::chrono::steady_clock::now();
    PingPong<<<1, 1>>>(buf, peer, rank, iters, 20000000000ull, done);
    CK(cudaDeviceSynchronize());
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    printf("{\"probe\": \"sm_ping_pong\", \"rank\": %d, \"iters\": %d, \"completed\": %d, \"us_per_round_trip\": %.1f}\n", rank, iters, *done, us / iters);
    fflush(stdout);
    // Copy engine: 64 KiB into the peer's buffer then a stream write of the flag, the
    // peer's one-thread wait kernel; ping-pong ce_iters times.
    void* fn = nullptr; cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &q));
    WriteValueFn wv = (WriteValueFn)fn;
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    unsigned* flag = buf + 1024; unsigned* peer_flag = peer + 1024;
    char* src; CK(cudaMalloc(&src, 65536)); CK(cudaMemset(src, 7, 65536));
    write(wfd, &c, 1); read(rfd, &c, 1);
    *done = 0;
    t0 = std::chrono::steady_clock::now();
    for (int i = 1; i <= ce_iters; ++i) {
      if (rank == 1) WaitFlag<<<1, 1, 0, s>>>(flag, i, 20000000000ull, done);
      CK(cudaMemcpyAsync((char*)peer + 8192, src, 65536, cudaMemcpyDeviceToDevice, s));
      if (wv(s, (CUdeviceptr)peer_flag, i, 0) != CUDA_SUCCESS) { fprintf(stderr, "writevalue failed\n"); exit(4); }
      if (rank == 0) WaitFlag<<<1, 1, 0, s>>>(flag, i, 20000000000ull, done);
    }
    CK(cudaStreamSynchronize(s));
    us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    printf("{\"probe\": \"copy_engine_ping_pong\", \"rank\": %d, \"iters\": %d, \"timed_out\": %d, \"us_per_round_trip\": %.1f}\n", rank, ce_iters, *done, us / ce_iters);
    CK(cudaIpcCloseMemHandle(peer_raw));
    exit(0);
  }
  int rc = 0;
  for (int r = 0; r < 2; ++r) { int st; waitpid(kids[r], &st, 0); if (!WIFEXITED(st) || WEXITSTATUS(st)) rc = 1; }
  return rc;
}
