// A user's program: two simulated devices, a buffer on each, a host -> device -> device -> host trip.
#include <dp/device.h>
#include <dp/error.h>

#include <cstdio>
#include <vector>

int main() {
  dp::RuntimeOptions options;
  options.backend = "sim";
  options.sim_devices = 2;
  auto runtime = dp::Runtime::create(options);
  std::vector<float> host(1000), back(1000, 0.0f);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i);
  auto a = runtime->device(0).allocate(host.size() * sizeof(float));
  auto b = runtime->device(1).allocate(host.size() * sizeof(float));
  dp::Stream s0 = runtime->device(0).create_stream();
  dp::Stream s1 = runtime->device(1).create_stream();
  s0.copy(a.data(), host.data(), a.size());
  dp::Event ready = runtime->device(0).create_event();
  s0.record(ready);
  s1.wait(ready);
  s1.copy(b.data(), a.data(), a.size());
  s1.copy(back.data(), b.data(), b.size());
  if (back != host || runtime->link_traffic(0, 1).bytes != a.size()) {
    std::puts("consumer: FAILED");
    return 1;
  }
  std::printf("consumer: ok (%llu bytes over link 0->1)\n",
              static_cast<unsigned long long>(runtime->link_traffic(0, 1).bytes));
  return 0;
}
