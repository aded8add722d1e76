// A deliberate data race and a deliberate heap overflow, for scripts/sanitize.sh to check that
// its sanitizer builds really report (a sanitizer job that reports nothing proves nothing).
// Usage: sanitizer_canary race | overflow
#include <cstdio>
#include <cstring>
#include <thread>

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "race") == 0) {
    int shared = 0;
    std::thread a([&] {
      for (int i = 0; i < 1000; ++i) ++shared;
    });
    std::thread b([&] {
      for (int i = 0; i < 1000; ++i) ++shared;
    });
    a.join();
    b.join();
    std::printf("%d\n", shared);
    return 0;
  }
  if (argc == 2 && std::strcmp(argv[1], "overflow") == 0) {
    volatile int n = 8;
    int* p = new int[n];
    p[n] = 1;
    std::printf("%d\n", p[0]);
    delete[] p;
    return 0;
  }
  std::fprintf(stderr, "usage: sanitizer_canary race | overflow\n");
  return 2;
}
