/* Embedding flashjit from C: one attention call (bf16, no mask) on random data through the C API,
 * its output checked against a float64 reference computed here. Exit status: 0 checked (or no
 * GPU), 1 a mismatch or an error. */
#include <cuda_runtime_api.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <flashjit/flashjit.h>

enum { kBatch = 1, kSeqlen = 200, kHeads = 2, kDim = 128 };

static uint16_t to_bf16(float x) { /* round to nearest even */
  uint32_t bits;
  memcpy(&bits, &x, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}
static float from_bf16(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float x;
  memcpy(&x, &bits, 4);
  return x;
}

/* A contiguous (batch, seqlen, heads, dim) bf16 tensor at `data`. */
static flashjit_tensor bshd_tensor(void* data) {
  flashjit_tensor t = {data, FLASHJIT_BFLOAT16, 0, 4, {kBatch, kSeqlen, kHeads, kDim},
                       {(int64_t)kSeqlen * kHeads * kDim, kHeads * kDim, kDim, 1}};
  return t;
}

int main(void) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    puts("attention_c: no GPU, skipped");
    return 0;
  }
  const size_t elements = (size_t)kBatch * kSeqlen * kHeads * kDim, bytes = elements * 2;
  uint16_t* host[4];
  void* device[4];
  srand(11);
  for (int t = 0; t < 4; ++t) {
    host[t] = malloc(bytes);
    if (host[t] == NULL || cudaMalloc(&device[t], bytes) != cudaSuccess) {
      fprintf(stderr, "attention_c: out of memory\n");
      return 1;
    }
    for (size_t i = 0; i < elements && t < 3; ++i) host[t][i] = to_bf16(2.f * rand() / RAND_MAX - 1.f);
    if (t < 3) cudaMemcpy(device[t], host[t], bytes, cudaMemcpyHostToDevice);
  }
  cudaMemset(device[3], 0xff, bytes); /* NaN: an unwritten element shows */

  const flashjit_tensor q = bshd_tensor(device[0]), k = bshd_tensor(device[1]), v = bshd_tensor(device[2]),
                        out = bshd_tensor(device[3]);
  flashjit_attention_options options;
  flashjit_attention_options_init(&options);
  if (flashjit_forward(&q, &k, &v, &out, NULL, &options) != FLASHJIT_OK) {
    fprintf(stderr, "attention_c: %s\n", flashjit_last_error());
    return 1;
  }
  if (cudaDeviceSynchronize() != cudaSuccess || cudaMemcpy(host[3], device[3], bytes, cudaMemcpyDeviceToHost) != cudaSuccess) {
    fprintf(stderr, "attention_c: the attention call failed on the device\n");
    return 1;
  }

  /* float64 reference: every row sees every key. */
  double error = 0, scores[kSeqlen], row[kDim];
  const double scale = 1.0 / sqrt((double)kDim);
#define AT(t, r, h, c) ((double)from_bf16(host[t][(((size_t)(r)) * kHeads + (h)) * kDim + (c)]))
  for (int h = 0; h < kHeads; ++h)
    for (int i = 0; i < kSeqlen; ++i) {
      double top = -INFINITY, sum = 0;
      for (int j = 0; j < kSeqlen; ++j) {
        double dot = 0;
        for (int c = 0; c < kDim; ++c) dot += AT(0, i, h, c) * AT(1, j, h, c);
        scores[j] = dot * scale;
        top = fmax(top, scores[j]);
      }
      for (int c = 0; c < kDim; ++c) row[c] = 0;
      for (int j = 0; j < kSeqlen; ++j) {
        const double p = exp(scores[j] - top);
        sum += p;
        for (int c = 0; c < kDim; ++c) row[c] += p * AT(2, j, h, c);
      }
      for (int c = 0; c < kDim; ++c) {
        const double got = AT(3, i, h, c);
        error = fmax(error, isnan(got) ? INFINITY : fabs(got - row[c] / sum));
      }
    }
  const int ok = error < 1e-2; /* bf16 output: 8 bits */
  printf("attention_c: flashjit %s, bf16 %dx%dx%dx%d: max |out - ref| %.2e: %s\n", flashjit_version(), kBatch, kSeqlen,
         kHeads, kDim, error, ok ? "ok" : "MISMATCH");
  for (int t = 0; t < 4; ++t) {
    free(host[t]);
    cudaFree(device[t]);
  }
  return ok ? 0 : 1;
}
