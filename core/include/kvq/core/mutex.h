// core's mutex: absl::Mutex, told to ThreadSanitizer. Debian's Abseil is built without TSan,
// so TSan cannot see absl::Mutex synchronize and would report every access made under one as
// a race; under -fsanitize=thread these wrappers announce each lock and unlock through TSan's
// mutex annotations, so the core tests run under TSan with no suppressions (scripts/sanitize.sh).
// Elsewhere they compile to the absl calls alone.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#if defined(__SANITIZE_THREAD__)
#define KVQ_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVQ_TSAN 1
#endif
#endif

#ifdef KVQ_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace kvq::core {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() {
#ifdef KVQ_TSAN
    __tsan_mutex_create(this, 0);
#endif
  }
  ~Mutex() {
#ifdef KVQ_TSAN
    __tsan_mutex_destroy(this, 0);
#endif
  }
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
#ifdef KVQ_TSAN
    __tsan_mutex_pre_lock(this, 0);
#endif
    mu_.Lock();
#ifdef KVQ_TSAN
    __tsan_mutex_post_lock(this, 0, 0);
#endif
  }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
#ifdef KVQ_TSAN
    __tsan_mutex_pre_unlock(this, 0);
#endif
    mu_.Unlock();
#ifdef KVQ_TSAN
    __tsan_mutex_post_unlock(this, 0);
#endif
  }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() {
#ifdef KVQ_TSAN
    __tsan_mutex_pre_lock(this, __tsan_mutex_read_lock);
#endif
    mu_.ReaderLock();
#ifdef KVQ_TSAN
    __tsan_mutex_post_lock(this, __tsan_mutex_read_lock, 0);
#endif
  }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() {
#ifdef KVQ_TSAN
    __tsan_mutex_pre_unlock(this, __tsan_mutex_read_lock);
#endif
    mu_.ReaderUnlock();
#ifdef KVQ_TSAN
    __tsan_mutex_post_unlock(this, __tsan_mutex_read_lock);
#endif
  }

 private:
  absl::Mutex mu_;
};

// Holds `mu` exclusively for its scope.
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// Holds `mu` shared for its scope.
class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) { mu_->ReaderLock(); }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace kvq::core
